"""What the tests that start real processes ask of them."""

import psutil


def alive(pid: int) -> bool:
    """Running, and not a zombie its parent has yet to reap."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
