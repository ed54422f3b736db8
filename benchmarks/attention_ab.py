"""A/B timing of two versions of the paged-attention kernel in one process (same GPU, same inputs).

    python benchmarks/attention_ab.py OLD.py    # OLD.py: another copy of pagedllm/kernels/paged_attention.py

Cases: kernels_bench.py's prefill rows (causal 1 x 1024, 8 x 1024, a 512-token chunk over a 3584-token prefix)
and two decode batches; each version's default tile configuration; also dense SDPA for the prefill rows.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels_bench as kb  # noqa: E402

from pagedllm.kernels import paged_attention as new  # noqa: E402


def main() -> None:
    spec = importlib.util.spec_from_file_location("paged_attention_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    cases = {
        "prefill 1 x 1024": [(1024, 1024)],
        "prefill 8 x 1024": [(1024, 1024)] * 8,
        "chunk 512 over 3584": [(512, 4096)],
        "decode 64 x 2048": [(1, 2048)] * 64,
        "decode 256 x 512": [(1, 512)] * 256,
    }
    print(f"{'case':>22} {'old us':>9} {'new us':>9} {'new/old':>8} {'sdpa us':>9} {'err new':>8}")
    for name, lens in cases.items():
        pb = kb.PagedBatch(lens, rotations=2 if lens[0][0] > 1 else kb.NUM_ROTATIONS)
        times = {}
        for label, mod in (("old", old), ("new", new), ("old", old), ("new", new)):
            kb.paged_attention = mod.paged_attention
            t = kb.median_ms(pb.triton_fn()) * 1e3
            times[label] = min(times.get(label, t), t)
        kb.paged_attention = new.paged_attention
        err = pb.check()
        sdpa = kb.median_ms(kb.dense_sdpa_fn(lens)) * 1e3 if lens[0][0] > 1 else float("nan")
        print(
            f"{name:>22} {times['old']:>9.1f} {times['new']:>9.1f} {times['new'] / times['old']:>8.3f} "
            f"{sdpa:>9.1f} {err:>8.1e}"
        )
        del pb


if __name__ == "__main__":
    main()
