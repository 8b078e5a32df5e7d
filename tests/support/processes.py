"""What the tests that start real processes ask of them."""

import psutil


def alive(pid: int) -> bool:
    """Running, and not a zombie its parent has yet to reap."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def vllm_children() -> list[psutil.Process]:
    """This process's vLLM engine processes (named VLLM::...), at any depth."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM"):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out
