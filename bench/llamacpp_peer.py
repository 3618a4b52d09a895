"""llama.cpp as a peer of ``bench/peers.py``, in a process of its own (no torch here, so no
OpenMP threads of torch's compete with llama.cpp's): loads one GGUF, then answers each JSON line
on stdin, ``{"prompts": [[token ids], …], "new": n}``, with ``[tok/s, ms per decode step]``.

    python bench/llamacpp_peer.py MODEL.gguf THREADS MAX_BATCH
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np


class LlamaCpp:
    """Batched greedy decoding with llama.cpp's C API (llama-cpp-python bindings)."""

    def __init__(self, path: Path, threads: int, max_batch: int, per_seq: int = 1024) -> None:
        import llama_cpp as lc

        n_ctx = max_batch * per_seq  # llama.cpp splits its context between the sequences
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = False  # its AMX Q4 path crashes on some Intel CPUs
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx
        cparams.n_ubatch = 512
        cparams.n_seq_max = max_batch
        cparams.n_threads = cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_ctx, 0, max_batch)

    def _add(self, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self.batch
        i = b.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
        b.seq_id[i][0] = seq
        b.n_tokens += 1

    def _argmax(self, i: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, i)
        arr = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)
        )
        return int(arr.argmax())

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, float]:
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        t0 = time.perf_counter()
        self.batch.n_tokens = 0
        last = []
        for s, p in enumerate(prompts):
            for j, tok in enumerate(p):
                self._add(tok, j, s, j == len(p) - 1)
            last.append(self.batch.n_tokens - 1)
        if lc.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("llama_decode failed on the prompts")
        nxt = [self._argmax(i) for i in last]
        pos = [len(p) for p in prompts]
        t1 = time.perf_counter()
        for _ in range(new - 1):
            self.batch.n_tokens = 0
            for s, tok in enumerate(nxt):
                self._add(tok, pos[s], s, True)
                pos[s] += 1
            if lc.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed")
            nxt = [self._argmax(i) for i in range(len(prompts))]
        wall = time.perf_counter() - t0
        return len(prompts) * new / wall, 1e3 * (time.perf_counter() - t1) / max(new - 1, 1)


def main() -> None:
    path, threads, max_batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    peer = LlamaCpp(path, threads, max_batch)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(peer.run(ask["prompts"], ask["new"])), flush=True)


if __name__ == "__main__":
    main()
