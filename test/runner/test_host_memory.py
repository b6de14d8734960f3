"""Host memory (core/memory.py): a freed layer goes back to the OS, a calibration pass's temporaries reuse heap
memory and hand it back when the pass ends. Each case runs in a fresh interpreter (the glibc settings are process-wide) and reads its resident memory
from /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

glibc_linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
                                 reason="glibc's mallopt / malloc_trim")
MIB = 1 << 20
RSS = """
import os
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
"""


def _run(code: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run([sys.executable, "-c", RSS + textwrap.dedent(code)], check=True, capture_output=True,
                          text=True, env={**os.environ, **(env or {})}).stdout.strip()


@glibc_linux
def test_a_freed_layer_goes_back_to_the_os_at_once() -> None:
    # between passes a block of 1 MiB or more is a mapping of its own: freeing 256 MiB of 4 MiB tensors unmaps them
    out = _run("""
        import torch
        from msmodelslim.core.memory import return_freed_tensors_to_os
        return_freed_tensors_to_os()
        layer = [torch.ones(1 << 20, dtype=torch.float32) for _ in range(64)]
        loaded = rss()
        del layer
        print(loaded, rss())
    """)
    loaded, freed = map(int, out.split())
    assert loaded - freed > 200 * MIB, (loaded, freed)


@glibc_linux
def test_a_pass_reuses_heap_memory_and_gives_it_back_after() -> None:
    # inside a pass, 4 MiB temporaries come from the heap, and once freed they stay resident, the heap's top
    # included, ready for the next forward's temporaries; leaving the pass hands their pages back
    out = _run("""
        import torch
        from msmodelslim.core.memory import heap_for_temporaries, return_freed_tensors_to_os
        return_freed_tensors_to_os()
        with heap_for_temporaries():
            temporaries = [torch.ones(1 << 20, dtype=torch.float32) for _ in range(64)]
            del temporaries
            inside = rss()
        print(inside, rss())
    """)
    inside, after = map(int, out.split())
    assert inside - after > 200 * MIB, (inside, after)
