"""Exact greedy picks over a dense vocabulary from a half-precision screen of the LM head (CPU).

A greedy row whose grammar allows much of the vocabulary (inside a JSON string) or that has no
grammar needs the argmax of ``h @ W^T`` over the allowed ids, which streams the whole fp32 head
(Gemma 3: 262,144 x 640, 671 MB; ~70 ms for one row, ~140-250 ms for 8 rows with MKL on one
AVX2 core). The screen computes ``h @ W16^T`` with fbgemm's fp16-weight GEMM (fp16 weights, fp32
activations and accumulation: half the bytes, a kernel built for small batches) and keeps every
allowed id whose exact logit could still be the maximum:

    |h . W_j - h . W16_j| <= |h|_2 * |W_j - W16_j|_2          (Cauchy-Schwarz, exact per row j)

plus a fp32-accumulation allowance ``4 * H * 2^-24 * |h|_2 * |W_j|_2`` for both products.
With ``bound_j`` their sum and ``t`` the allowed id of the largest ``approx``, id j stays a
candidate iff ``approx_j + bound_j >= approx_t - bound_t`` (over allowed j): the true argmax
stays, its exact logit being at least t's.
The caller computes the candidates' logits exactly in fp32 (a gathered sub-head, as for sparse
masks), so greedy picks are those of the full fp32 head. On the default model's bench rows:
one candidate (median), at most a handful.

Built once per model (fp16 packing takes seconds), on a background thread: steps use the fp32
head until it is ready. Needs torch built with fbgemm (x86 CPU wheels); otherwise never ready.
"""

from __future__ import annotations

import threading

import torch

_FP32_ALLOWANCE = 4 * 2.0**-24  # per reduction element, for the screen's and the exact product


def screen_available() -> bool:
    """Whether this torch has fbgemm's fp16-weight GEMM (x86 CPU builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_dynamic_fp16"
    )


class HeadScreen:
    """fp16 screen of one LM head ``weight`` (fp32 ``[V, H]``, CPU), built on a thread.

    ``ready`` is False until the packing finishes (or forever, when fbgemm is missing or the
    build failed); ``candidates`` may only be called once ready.
    """

    def __init__(self, weight: torch.Tensor, *, background: bool = True) -> None:
        self._weight = weight.detach()
        self._packed: torch.Tensor | None = None  # fbgemm's packed fp16 weight
        # fp32 [V]: |W_j - W16_j|_2 + allowance * |W_j|_2 (bound_j per unit of |h|_2)
        self._unit: torch.Tensor | None = None
        self._done = threading.Event()
        if not (
            screen_available() and weight.dtype == torch.float32 and weight.device.type == "cpu"
        ):
            return
        if background:
            # not a daemon: the interpreter waits for it at exit. A daemon thread still inside
            # torch's kernels while the process tears down its native thread pools aborts it
            # ("terminate called without an active exception", exit status 134).
            threading.Thread(target=self._build, name="espalier-head-screen").start()
        else:
            self._build()

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> HeadScreen:
        """The screen of ``model.head_weight()``, built once per model object (engines sharing a
        runner share it)."""
        screen = model.__dict__.get("_espalier_head_screen")
        if screen is None:
            screen = cls(model.head_weight())  # type: ignore[operator]
            model.__dict__["_espalier_head_screen"] = screen
        return screen

    @property
    def ready(self) -> bool:
        return self._done.is_set() and self._packed is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build finished (tests, benchmarks); True when ready."""
        self._done.wait(timeout)
        return self.ready

    def _build(self) -> None:
        try:
            with torch.inference_mode():
                w = self._weight
                err = torch.empty(w.shape[0], dtype=torch.float32)
                for start in range(0, w.shape[0], 16384):  # bounded temporaries
                    chunk = w[start : start + 16384]
                    err[start : start + 16384] = (chunk - chunk.half().float()).norm(dim=1)
                self._unit = err + _FP32_ALLOWANCE * w.shape[1] * w.norm(dim=1)
                self._packed = torch.ops.quantized.linear_prepack_fp16(w, None)
        except Exception:  # no screen: the fp32 head serves every row
            self._packed = None
        finally:
            self._done.set()

    @torch.inference_mode()
    def candidates(self, hidden: torch.Tensor, allowed: torch.Tensor | None) -> list[torch.Tensor]:
        """Per row of ``hidden`` (fp32 ``[m, H]``, CPU), the sorted int64 ids that may hold the
        maximum exact logit among its allowed ids.

        allowed: bool ``[m, V]`` (CPU) or None (every id allowed). A row allowing nothing gets
        an empty tensor.

        With ``a`` the screen's logits, ``b_j = |h| * unit_j`` their bounds and ``t`` the
        allowed id of the largest ``a``: every exact logit that can be the maximum is at least
        ``floor = a_t - b_t`` (the exact logit of ``t`` is), so its id ``j`` has
        ``a_j + b_j >= floor``. Two passes over ``[m, V]`` (argmax, one compare against the
        row's ``floor - max_j b_j``) and one ``nonzero`` for the batch find a small superset;
        the exact test runs on it alone.
        """
        assert self._packed is not None and self._unit is not None
        unit = self._unit
        h = hidden.float().contiguous()
        approx = torch.ops.quantized.linear_dynamic_fp16(h, self._packed)  # [m, V]
        if allowed is not None:
            approx.masked_fill_(~allowed, float("-inf"))
        norm = h.norm(dim=1)  # [m]
        top = approx.argmax(dim=1)  # [m]
        rows = torch.arange(h.shape[0])
        best = approx[rows, top]
        floor = best - norm * unit[top]
        # a row allowing nothing: no candidate (its approx is all -inf)
        floor = torch.where(torch.isfinite(best), floor, float("inf"))
        coarse = approx >= (floor - norm * unit.max())[:, None]
        row_ids, ids = coarse.nonzero(as_tuple=True)  # row-major: ids sorted within a row
        exact = approx[row_ids, ids] + norm[row_ids] * unit[ids] >= floor[row_ids]
        row_ids, ids = row_ids[exact], ids[exact]
        counts = torch.bincount(row_ids, minlength=h.shape[0]).tolist()
        return list(torch.split(ids, counts))
