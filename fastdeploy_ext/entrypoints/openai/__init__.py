"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

`api_server` (start-up, app, lifecycle), `cli_args` (flags), `protocol` (request models,
response shapes), `errors` (OpenAI's error JSON), `media` (image URLs -> bytes), `metrics`
(Prometheus), `serving_chat` (a chat request through the engine, plain or streamed)."""
