#!/bin/sh
# The cpu/ui leg's setup: headless Chromium from the distribution's packages when none is on the
# PATH (never a browser downloaded by the tests). Debian names it chromium; Ubuntu's apt offers
# chromium-browser (a snap wrapper) or chromium-headless-shell on newer releases.
set -e
for b in chromium chromium-browser chromium-headless-shell google-chrome; do
    if command -v "$b" >/dev/null 2>&1; then
        echo "setup_browser: $b is here ($(command -v "$b"))"
        exit 0
    fi
done
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
for pkg in chromium chromium-headless-shell chromium-browser; do
    if $SUDO apt-get install -y -q --no-install-recommends "$pkg"; then
        echo "setup_browser: installed $pkg"
        exit 0
    fi
done
echo "setup_browser: no Chromium package could be installed with apt" >&2
exit 1
