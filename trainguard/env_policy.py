"""Which environment names a run spec may give its ranks on a node, unless the node's operator allows more.

A node may allow only a fixed launcher (`--allow`), so a spec's env is the one thing its author still controls
there. A name is refused when it can change what the rank runs or loads, or where it writes as the agent's user:
`TORCH_LOGS_OUT` made `import torch` create a file at any path, `CXX` is the compiler torch.compile runs, and
`NVTX_INJECTION64_PATH` names a library to load.

Two rules, because the danger lives in names some library reads, not in the names a user's own script reads:
- Names in a family owned by a library or tool the rank loads (`TOOL_ENV_PREFIXES`: `TORCH_*`, `NCCL_*`,
  `CUDA_*`, `HF_*`, ...) pass only when they are on the allow-list of knobs known to be harmless
  (`HARMLESS_ENV`, `HARMLESS_ENV_PATTERNS`): a knob a new release adds is refused until it is reviewed.
- Any other name is the user's own (`MY_LR`, `SEED`, `DATA_DIR`) and passes, unless it matches a family that
  generic code reads to find programs, libraries, hooks or scratch space (`EXEC_ENV_PATTERNS`: `*PATH`,
  `LD_*`, `PYTHON*`, `HOME`, `CC`, `CXX`, `TMPDIR`, proxies, ...). Such a user name (`MODEL_PATH`) needs the
  operator's `--allow-env` or a new name.
An operator lets a spec set any refused name by allowing it by name (`--allow-env NAME`). Spec validation
cannot know what a node allows, so the CLI only warns and the node agent refuses, failing the run as a user
error naming `env.NAME`.
"""

from __future__ import annotations

import fnmatch

EXEC_ENV_PATTERNS: tuple[str, ...] = (
    "PATH",
    "LD_*", "DYLD_*",
    "PYTHON*",
    "*PATH",
    "*_INJECTION*",
    "HOME", "*_HOME",
    "TMPDIR", "TMP", "TEMP", "XDG_*",
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "IFS", "SHELL", "EDITOR", "VISUAL", "PAGER", "BROWSER",
    "CC", "CXX", "CPP", "LD", "AS", "AR", "NM", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED",
    "MAKEFLAGS", "NVCC_*", "CMAKE_*",
    "GCONV_PATH",
    "OPENSSL_*", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
    "GIT_*", "PIP_*",
    "PERL5LIB", "PERLLIB", "PERL5OPT", "PERL5DB",
    "RUBYLIB", "RUBYOPT",
    "NODE_OPTIONS", "NODE_PATH",
    "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "CLASSPATH",
)
"""Shell-style patterns (case as the loader reads them) of names generic code reads to find what to run, load
or write, refused whatever family they are in: `PATH` and every `*PATH` (`LD_LIBRARY_PATH`, `GCONV_PATH`,
`LIBRARY_PATH`, `CPATH`, `NVTX_INJECTION64_PATH`), the dynamic loader's `LD_*` and macOS's `DYLD_*`, Python's
`PYTHON*` (`PYTHONPATH`, `PYTHONSTARTUP`, `PYTHONWARNINGS` imports what it names, `PYTHONBREAKPOINT` a
callable) but for `PYTHON_KNOBS`, injection hooks (`CUDA_INJECTION64_PATH`), `HOME` and `*_HOME` (Python's
user site-packages run their `.pth` files; `CUDA_HOME` says which `nvcc` runs), scratch space (`TMPDIR`,
`XDG_*`), what shells run (`BASH_ENV`, `ENV`, `PS4` with `SHELLOPTS`, `IFS`, `SHELL`, `EDITOR`), the compilers
and flags torch.compile, Triton and extension builds run (`CC`, `CXX`, `CFLAGS`, `NVCC_*`, `CMAKE_*`), OpenSSL's
config, engines and providers, trust stores and proxies (downloads of code, such as a model's remote code,
come from elsewhere), git's and pip's hooks, and the start-up hooks of Perl, Ruby, Node and Java."""

PYTHON_KNOBS = frozenset({"PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
                          "PYTHONUTF8", "PYTHONIOENCODING"})
"""`PYTHON*` names exempt from `EXEC_ENV_PATTERNS`: they change buffering, hashing, crash dumps, bytecode files
and the text encoding, never what is imported, and training scripts set them for logs and reproducibility."""

TOOL_ENV_PREFIXES: tuple[str, ...] = (
    "TORCH", "PYTORCH_",
    "TRITON_",
    "NCCL_", "GLOO_",
    "CUDA_", "CUDNN_", "CUBLAS", "CUFFT", "CUSPARSE", "NVIDIA_", "NVTX_", "NV_", "CUPTI",
    "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
    "MALLOC_", "GLIBC_",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_",
    "AWS_",
    "WANDB_",
)
"""Prefixes of the names read by the libraries and tools a rank loads (torch, Triton, NCCL, gloo, CUDA and its
libraries, OpenMP and BLAS, glibc, Hugging Face, the AWS SDK, Weights & Biases). In these families only the
knobs `HARMLESS_ENV` and `HARMLESS_ENV_PATTERNS` name pass: a new knob is refused until someone has read what
it does (`TORCH_LOGS_OUT` writes a file, `TORCH_HOME` and `HF_MODULES_CACHE` hold code that is loaded,
`NCCL_CONF_FILE` can name a plugin, `AWS_CONFIG_FILE` a `credential_process` to run, `HF_ENDPOINT` where remote
code comes from, `MALLOC_TRACE` a file to write)."""

HARMLESS_ENV = PYTHON_KNOBS | frozenset({
    # torch: distributed timeouts, debug levels, logging to stderr, allocator tuning.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ENABLE_MONITORING",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_AVOID_RECORD_STREAMS",
    "TORCH_NCCL_HIGH_PRIORITY", "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_FR_BUFFER_SIZE",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "TORCH_LOGS",
    "TORCH_LOGS_FORMAT", "TORCH_USE_CUDA_DSA", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_CUDNN_V8_API_LRU_CACHE_LIMIT",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TORCH_COMPILE_DISABLE", "TORCHDYNAMO_DISABLE", "TORCHDYNAMO_VERBOSE",
    "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_FORCE_DISABLE_CACHES",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    # NCCL and gloo: which interfaces and transports, how many channels and threads, what to log to stderr.
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS",
    "NCCL_BUFFSIZE", "NCCL_NTHREADS", "NCCL_LAUNCH_MODE", "NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE",
    "NCCL_CROSS_NIC", "NCCL_NET_GDR_LEVEL", "NCCL_NET_GDR_READ", "NCCL_NSOCKS_PERTHREAD", "NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_BLOCKING_WAIT", "NCCL_CHECKS_DISABLE", "NCCL_COLLNET_ENABLE", "NCCL_TREE_THRESHOLD",
    "GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT",
    # TorchFT: what trainguard gives the ranks of a run with replica groups (the group, and where the lighthouse
    # serves), and its timeouts.
    "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "TORCHFT_LIGHTHOUSE", "TORCHFT_TIMEOUT_SEC",
    "TORCHFT_QUORUM_TIMEOUT_SEC", "TORCHFT_CONNECT_TIMEOUT_SEC", "TORCHFT_QUORUM_RETRIES",
    # CUDA: which devices, in what order, how kernels launch and load.
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
    "CUDA_MODULE_LOADING", "CUDA_CACHE_DISABLE", "CUDA_CACHE_MAXSIZE", "CUBLAS_WORKSPACE_CONFIG",
    "NVIDIA_TF32_OVERRIDE",
    # OpenMP and BLAS threads and affinity.
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_SCHEDULE", "OMP_DYNAMIC", "OMP_WAIT_POLICY",
    "OMP_STACKSIZE", "OMP_MAX_ACTIVE_LEVELS", "OMP_DISPLAY_ENV", "KMP_AFFINITY", "KMP_BLOCKTIME",
    "KMP_DUPLICATE_LIB_OK", "GOMP_CPU_AFFINITY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS", "MKL_DYNAMIC",
    "OPENBLAS_NUM_THREADS",
    # glibc's allocator and tunables.
    "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
    "GLIBC_TUNABLES",
    # Hugging Face: offline, quiet, timeouts (never where code or caches come from).
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HUB_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_SYMLINKS_WARNING", "HF_HUB_VERBOSITY", "TRANSFORMERS_VERBOSITY",
    "HF_HUB_DOWNLOAD_TIMEOUT", "HF_HUB_ETAG_TIMEOUT",
    # AWS SDK: the region only (its files and endpoints stay the node's).
    "AWS_REGION", "AWS_DEFAULT_REGION",
    # Weights & Biases: what the run is called and whether it logs (never where it writes or sends).
    "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_JOB_TYPE", "WANDB_TAGS",
    "WANDB_NOTES", "WANDB_SILENT", "WANDB_QUIET", "WANDB_DISABLED", "WANDB_CONSOLE", "WANDB_WATCH",
})
"""Knobs in the tool families (`TOOL_ENV_PREFIXES`) known to change how a rank runs, never what it runs, loads,
or where it writes. Being here also exempts a name from `EXEC_ENV_PATTERNS` (`PYTHON_KNOBS`)."""

HARMLESS_ENV_PATTERNS: tuple[str, ...] = (
    "NCCL_SOCKET_*", "NCCL_IB_*", "NCCL_P2P_*", "NCCL_SHM_*",
    "*_NUM_THREADS",
)
"""Whole sub-families of tuning knobs that pass in the tool families: NCCL's socket, InfiniBand, peer-to-peer
and shared-memory transports (interfaces, timeouts, levels) and thread counts. `EXEC_ENV_PATTERNS` still
applies to them."""


def exec_env_refused(name: str, allowed: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a rank's env may not set `name` on a node whose operator allowed `allowed` (`--allow-env`)."""
    if name in allowed or name in HARMLESS_ENV:
        return False
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in EXEC_ENV_PATTERNS):
        return True
    return name.startswith(TOOL_ENV_PREFIXES) and \
        not any(fnmatch.fnmatchcase(name, pattern) for pattern in HARMLESS_ENV_PATTERNS)
