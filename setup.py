from setuptools import find_packages, setup

SERVE = ["fastapi>=0.110", "uvicorn>=0.30", "prometheus-client>=0.20", "httpx>=0.27", "anyio>=4",
         "python-multipart>=0.0.9"]    # the job API's file uploads

setup(
    name="fastdeploy_ext",
    version="0.1.0",
    description="Fast multi-vendor inference of OCR vision-language models (PaddleOCR-VL)",
    python_requires=">=3.10",
    license="Apache-2.0",
    license_files=["LICENSE"],
    packages=find_packages(include=["fastdeploy_ext", "fastdeploy_ext.*", "backends", "backends.*"]),
    # the conformance suite's references (tiny checkpoints, images, expected outputs; see
    # fastdeploy_ext/conformance/references.py): the suite runs without transformers. Each backend
    # ships its capability rows next to its runner (fastdeploy_ext/capabilities.py).
    package_data={"fastdeploy_ext.conformance": ["reference_data/*.json", "reference_data/*/*"],
                  "fastdeploy_ext.models.pp_doclayout_v2": ["reference_data/*"],
                  "backends.cuda": ["capabilities.yaml"], "backends.metax": ["capabilities.yaml"],
                  "backends.cpu_amx": ["capabilities.yaml"],
                  "fastdeploy_ext.entrypoints.openai.ui": ["index.html"]},      # `serve`'s /ui page
    install_requires=[
        "torch>=2.11,<2.14",
        "numpy",
        "safetensors>=0.4",
        "pyyaml>=6",
        "pillow>=10",
        "py-cpuinfo>=9",
        "tokenizers>=0.20",     # the model dir's tokenizer.json
        "jinja2>=3",            # chat templates
        "tqdm>=4.60",           # progress bars: LLM.generate/chat, `generate`
        "pypdfium2>=4.30",      # `parse`: PDF pages rendered by PDFium
    ],
    extras_require={
        "cuda": ["nvidia-ml-py>=12", "triton>=3.4"],
        # FlashAttention-3 forward kernels (Hopper, bf16) for the fa3_varlen attention backend
        "fa3": ["fa3-fwd==0.0.3"],
        # pymxsml ships with the MACA SDK (not on PyPI): the extra exists so deployment recipes
        # can name it; it adds nothing.
        "metax": [],
        # Paddle tensors in and out of a runner (fastdeploy_ext/interop/paddle.py, for FastDeploy
        # workers) and its tests; Paddle-layout checkpoints alone need only safetensors. The CPU
        # wheel (~195 MB) is enough for the tests; a FastDeploy GPU worker brings its own Paddle.
        "paddle": ["paddlepaddle==3.3.1"],
        # the OpenAI-compatible server (`fastdeploy-ext serve`): FastAPI on uvicorn, Prometheus
        # metrics, httpx for http(s) image URLs and for `bench serve`'s load generator
        "serve": SERVE,
        # `bench parse --plots DIR`: the stage breakdown and GPU-busy timeline as PNG charts
        "plots": ["matplotlib>=3.7"],
        # `parse --ray`: the parse pipeline's workers as Ray actors on a cluster (the wheel is ~79 MB;
        # its CI leg installs it in its own environment)
        "ray": ["ray==2.60.0"],
        # transformers 5.24 is the numerical reference; Triton runs the attention kernel's
        # interpreter-mode tests on the CPU; the server tests drive the server with `openai`;
        # hypothesis runs the property tests (fixed seeds and example counts).
        "test": ["pytest>=8", "transformers==5.24.0", "nvidia-ml-py>=12",
                 "triton==3.6.0; platform_system == 'Linux' and platform_machine == 'x86_64'",
                 "openai>=1.40", "hypothesis>=6",
                 "pypdf>=4",            # encrypted-PDF fixtures for the parsing tests
                 # the job API's tests drive it with paddleocr's own API client (its files from
                 # the paddleocr==3.7.0 wheel), which needs these two
                 "requests>=2.28", "aiohttp>=3.9",
                 "matplotlib>=3.7",     # bench parse --plots
                 *SERVE],
    },
    entry_points={
        "console_scripts": ["fastdeploy-ext=fastdeploy_ext.entrypoints.cli:main"],
        "fastdeploy_ext.backends": [
            "cuda=backends.cuda:CudaRunner",
            "metax=backends.metax:MetaxRunner",
            "cpu_amx=backends.cpu_amx:CpuAmxRunner",
            "cpu=backends.cpu_amx:CpuRunner",
        ],
        # model families (fastdeploy_ext/models/registry.py): built-ins register as out-of-tree ones do
        "fastdeploy_ext.models": ["paddleocr_vl=fastdeploy_ext.models.paddleocr_vl.family:PaddleOCRVLFamily",
                                  "pp_doclayout_v3=fastdeploy_ext.models.pp_doclayout_v3.family:PPDocLayoutV3Family",
                                  "pp_doclayout_v2=fastdeploy_ext.models.pp_doclayout_v2.family:PPDocLayoutV2Family",
                                  "deepseek_ocr2=fastdeploy_ext.models.deepseek_ocr2.family:DeepseekOCR2Family"],
        "pytest11": ["fastdeploy_ext_conformance=fastdeploy_ext.conformance.plugin"],
    },
)
