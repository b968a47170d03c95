"""Which env names a spec may give its ranks: the tool families' harmless knobs and the user's own names pass;
what changes what a rank runs, loads or where it writes needs the node operator's `--allow-env`."""

from __future__ import annotations

import pytest

from trainguard.env_policy import (EXEC_ENV_PATTERNS, HARMLESS_ENV, HARMLESS_ENV_PATTERNS, TOOL_ENV_PREFIXES,
                                   exec_env_refused)
from trainguard.spec import parse_spec

REFUSED = [
    # The review's findings, on a node that allows only a fixed launcher.
    "TORCH_LOGS_OUT",         # `import torch` created a file at any path
    "CXX",                    # the compiler torch.compile runs
    "NVTX_INJECTION64_PATH",  # a library NVTX loads
    # A tool family's knob nobody has reviewed, or one that writes, loads or fetches code.
    "TORCH_HOME", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    "TORCH_FR_DUMP_TEMP_FILE", "TORCH_TRACE", "TORCHELASTIC_ERROR_FILE", "TRITON_CACHE_DIR", "NCCL_DEBUG_FILE",
    "NCCL_CONF_FILE", "NCCL_TOPO_DUMP_FILE", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "CUDA_INJECTION64_PATH",
    "CUDA_CACHE_PATH", "CUDNN_LOGDEST_DBG", "OMP_TOOL_LIBRARIES", "MALLOC_TRACE", "MALLOC_CONF", "HF_HOME",
    "HF_MODULES_CACHE", "HF_ENDPOINT", "TRANSFORMERS_CACHE", "AWS_CONFIG_FILE", "AWS_ENDPOINT_URL", "WANDB_DIR",
    "WANDB_BASE_URL", "TORCH_SOME_FUTURE_KNOB",
    # Generic code's programs, libraries, hooks and scratch space.
    "PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "DYLD_INSERT_LIBRARIES", "PYTHONPATH", "PYTHONHOME",
    "PYTHONSTARTUP", "PYTHONWARNINGS", "PYTHONBREAKPOINT", "HOME", "CUDA_HOME", "JAVA_HOME", "TMPDIR", "TMP",
    "XDG_CACHE_HOME", "BASH_ENV", "ENV", "PS4", "IFS", "SHELL", "CC", "CFLAGS", "LDFLAGS", "NVCC_PREPEND_FLAGS",
    "GCONV_PATH", "LOCPATH", "LIBRARY_PATH", "CPATH", "OPENSSL_CONF", "OPENSSL_MODULES", "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE", "HTTPS_PROXY", "https_proxy", "GIT_SSH_COMMAND", "NODE_OPTIONS", "PERL5OPT",
    "JAVA_TOOL_OPTIONS", "CLASSPATH",
    # A user's own name in a dangerous family: the operator allows it, or the user renames it.
    "MODEL_PATH", "MY_INJECTION_HOOK",
]

PASSES = [
    # The user's own names: what only their (allowed) script reads.
    "MY_LR", "SEED", "DATA_DIR", "OUTPUT_DIR", "CONFIG_FILE", "EPOCHS", "TOKENIZERS_PARALLELISM", "path",
    "XLD_PRELOAD", "MY_PATHS_FILE", "LOGLEVEL",
    # Tuning knobs of the tool families.
    "PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "MALLOC_ARENA_MAX", "GLIBC_TUNABLES", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_P2P_DISABLE",
    "GLOO_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_DISTRIBUTED_DEBUG", "TORCH_LOGS",
    "TORCHINDUCTOR_MAX_AUTOTUNE", "PYTORCH_CUDA_ALLOC_CONF", "HF_HUB_OFFLINE", "AWS_REGION", "WANDB_PROJECT",
    "WANDB_MODE",
]


@pytest.mark.parametrize("name", REFUSED)
def test_names_that_change_what_runs_loads_or_writes_need_the_operator(name: str) -> None:
    assert exec_env_refused(name)
    assert not exec_env_refused(name, allowed={name})  # the operator's `--allow-env NAME`
    assert exec_env_refused(name, allowed={"SOMETHING_ELSE"})


@pytest.mark.parametrize("name", PASSES)
def test_harmless_knobs_and_the_users_own_names_pass(name: str) -> None:
    assert not exec_env_refused(name)


@pytest.mark.parametrize("name", ["TORCH_LOGS_OUT", "CXX", "NVTX_INJECTION64_PATH", "MODEL_PATH"])
def test_a_spec_with_such_a_name_is_valid_and_says_what_the_node_will_refuse(name: str) -> None:
    spec = parse_spec({"entrypoint": ["python", "train.py"], "nodes": ["node-0"], "env": {name: "x", "MY_LR": "1"}})

    assert spec.exec_env() == [name]  # the spec cannot know what a node allows; the CLI warns, the agent refuses


def test_no_harmless_knob_is_a_dangerous_name_in_disguise() -> None:
    import fnmatch

    for name in HARMLESS_ENV:
        dangerous = [p for p in EXEC_ENV_PATTERNS if fnmatch.fnmatchcase(name, p)]
        assert not dangerous or name.startswith("PYTHON"), (name, dangerous)  # only the Python knobs are exempt
        assert not any(word in name for word in ("PATH", "FILE", "DIR", "HOME", "CACHE_DIR", "PLUGIN", "INJECT"))
    for pattern in HARMLESS_ENV_PATTERNS:
        assert pattern.startswith(TOOL_ENV_PREFIXES) or pattern.startswith("*_"), pattern


def test_a_harmless_pattern_never_lifts_a_dangerous_one() -> None:
    assert exec_env_refused("NCCL_SOCKET_LIBRARY_PATH")  # `NCCL_SOCKET_*` passes, `*PATH` still refuses
