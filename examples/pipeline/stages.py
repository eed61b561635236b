"""What each process of the pipeline computes, independent of how records travel.

The same functions run in the ringwire pipeline (:mod:`pipeline.workers`) and in the
ZeroMQ peers of ``perf/pipeline.py``, so the benchmark compares transports, not work.

* :func:`parse_request` -- the front end: a JSON body checked into a
  :class:`~pipeline.records.GenerateRequest` (``ValueError`` says what is wrong).
* :func:`process` -- the tokenizer: tokens, image placeholder spans, the pixel
  values written into a tensor, a 64-bit hash: a ``TokenizedRequest`` carrying a
  ``MultimodalProcessorOutput``.  Images are synthetic (every pixel of image ``k`` is
  :func:`pixel_value`), so the answer can be checked without sending pixels over HTTP.
* :func:`rank_compute` -- one tensor-parallel rank: its shard of every feature summed
  (float64), and the output tokens, the same on every rank.
* :func:`combine` -- the scheduler: every rank's output of a step into one reply per
  request (checking that the ranks agree).
* :func:`expected` -- what the reply to a request must say (for tests and the load
  generator).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .records import (
    DTYPES,
    MAX_IMAGES,
    MAX_PROMPT,
    MAX_SIZE,
    GenerateRequest,
    Modality,
    MultimodalDataItem,
    MultimodalProcessorOutput,
    RankOutput,
    Reply,
    Step,
    TokenizedRequest,
)

__all__ = [
    "IM_END_ID",
    "IM_START_ID",
    "IM_TOKEN_ID",
    "combine",
    "expected",
    "feature_shape",
    "image_tokens",
    "parse_request",
    "pixel_value",
    "process",
    "rank_compute",
    "torch_dtype",
]

# Qwen2-VL's special tokens
IM_START_ID = 151652
IM_END_ID = 151653
IM_TOKEN_ID = 151655
PATCH = 14  # pixels per patch side
MERGE = 2  # patches merged per side into one token


def parse_request(body: Any, rid: str) -> GenerateRequest:
    """A JSON body ``{"prompt": str, "images": 0-4, "seed": int, "dtype": "float32" |
    "bfloat16", "size": 28-448 (a multiple of 28), "max_new_tokens": 1-16}`` (all but
    ``prompt`` optional) as a request.  Raises ``ValueError`` naming the bad field."""
    if not isinstance(body, Mapping):
        raise ValueError("the body must be a JSON object")
    unknown = set(body) - {"prompt", "images", "seed", "dtype", "size", "max_new_tokens"}
    if unknown:
        raise ValueError(f"unknown field(s) {sorted(unknown)}")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT:
        raise ValueError(f"prompt must be a string of at most {MAX_PROMPT} characters")

    def integer(name: str, default: int, lo: int, hi: int) -> int:
        v = body.get(name, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"{name} must be an integer from {lo} to {hi}, not {v!r}")
        return v

    images = integer("images", 0, 0, MAX_IMAGES)
    seed = integer("seed", 0, 0, 2**31 - 1)
    size = integer("size", MAX_SIZE, PATCH * MERGE, MAX_SIZE)
    if size % (PATCH * MERGE):
        raise ValueError(f"size must be a multiple of {PATCH * MERGE}, not {size}")
    max_new = integer("max_new_tokens", 4, 1, 16)
    dtype = body.get("dtype", "float32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    return GenerateRequest(
        rid=rid, prompt=prompt, images=images, seed=seed, dtype=dtype, size=size,
        max_new_tokens=max_new,
    )  # fmt: skip


def pixel_value(seed: int, k: int) -> float:
    """Every pixel of image ``k`` of a request with ``seed``: a multiple of 1/8 in
    [-6, 6], exact in float32 and bfloat16, so sums are exact in float64."""
    return ((seed * 31 + k * 7) % 97) / 8.0 - 6.0


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def feature_shape(req: GenerateRequest) -> tuple[int, int, int, int]:
    return (req.images, 3, req.size, req.size)


def image_tokens(size: int) -> int:
    """Placeholder tokens of one image (Qwen2-VL: 14-pixel patches, 2 x 2 merged)."""
    return (size // PATCH // MERGE) ** 2


def _hash(req: GenerateRequest) -> int:
    """A 64-bit content hash (SGLang hashes the feature; the content here follows from
    the seed, so hash that)."""
    key = f"{req.seed}:{req.images}:{req.size}:{req.dtype}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def _text_ids(prompt: str) -> list[int]:
    return [b + 3 for b in prompt.encode("utf-8")]  # a byte-level "tokenizer"


def process(req: GenerateRequest, feature: Any) -> TokenizedRequest:
    """The tokenizer's work: fills ``feature`` (a tensor of :func:`feature_shape`, or
    ``None`` when there are no images) with the pixel values and returns the tokenized
    request around it."""
    ids = _text_ids(req.prompt)
    items: list[MultimodalDataItem] = []
    if req.images:
        for k in range(req.images):
            feature[k].fill_(pixel_value(req.seed, k))
        h = _hash(req)
        per = image_tokens(req.size)
        pad = h % (1 << 30)  # SGLang: pad_value = hash % (1 << 30)
        offsets = []
        for _ in range(req.images):
            ids.append(IM_START_ID)
            offsets.append((len(ids), len(ids) + per - 1))
            ids.extend([pad] * per)
            ids.append(IM_END_ID)
        item = MultimodalDataItem(
            modality=Modality.IMAGE if req.images == 1 else Modality.MULTI_IMAGES,
            hash=h, pad_value=pad, offsets=offsets, feature=feature,
        )  # fmt: skip
        grid = req.size // PATCH
        item.image_grid_thw = np.array([[1, grid, grid]] * req.images, dtype=np.int64)
        item.num_image_tokens = np.int64(per * req.images)
        items.append(item)
    mm = MultimodalProcessorOutput(
        input_ids=ids, mm_items=items, im_token_id=IM_TOKEN_ID, im_start_id=IM_START_ID,
        im_end_id=IM_END_ID,
    )  # fmt: skip
    return TokenizedRequest(
        rid=req.rid, input_text=req.prompt, mm_inputs=mm, max_new_tokens=req.max_new_tokens
    )


def _output_ids(n_input: int, h: int, n: int) -> list[int]:
    """The "generated" tokens: they follow from the input length and the hash."""
    return [(n_input + (h >> (16 * (i % 4)))) % 151643 for i in range(n)]


def rank_compute(step: Step, rank: int, ranks: int) -> RankOutput:
    """Rank ``rank`` of ``ranks``: the float64 sum of its contiguous shard of every
    request's feature (together the ranks read each feature once), and the output
    tokens."""
    import torch

    sums: list[float] = []
    outs: list[list[int]] = []
    for req in step.reqs:
        mm = req.mm_inputs
        total = 0.0
        h = 0
        for item in mm.mm_items:
            h = item.hash or 0
            feat = item.feature
            if feat is not None:
                flat = feat.reshape(-1)
                n = flat.numel()
                lo, hi = rank * n // ranks, (rank + 1) * n // ranks
                total += float(flat[lo:hi].sum(dtype=torch.float64))
        sums.append(total)
        outs.append(_output_ids(len(mm.input_ids), h, req.max_new_tokens))
    return RankOutput(step=step.step, rank=rank, partial_sums=sums, output_ids=outs)


def combine(step: Step, outputs: Sequence[RankOutput]) -> list[Reply]:
    """The scheduler: one reply per request of ``step`` from every rank's output.
    Raises ``ValueError`` when an output belongs to another step or the ranks
    disagree."""
    ranks = len(outputs)
    for out in outputs:
        if out.step != step.step or len(out.partial_sums) != len(step.reqs):
            raise ValueError(f"rank {out.rank} answered step {out.step} for step {step.step}")
    replies = []
    for i, req in enumerate(step.reqs):
        ids = outputs[0].output_ids[i]
        if any(o.output_ids[i] != ids for o in outputs):
            raise ValueError(f"the ranks disagree on the output of {req.rid!r}")
        mm = req.mm_inputs
        n_img = sum(1 for t in mm.input_ids if t == IM_START_ID)
        replies.append(
            Reply(
                rid=req.rid,
                output_ids=ids,
                feature_sum=sum(o.partial_sums[i] for o in outputs),
                image_tokens=len(mm.input_ids) - len(req.input_text.encode("utf-8")) - 2 * n_img,
                ranks=ranks,
                step=step.step,
                batch=len(step.reqs),
            )
        )
    return replies


def expected(req: GenerateRequest) -> dict[str, Any]:
    """What a correct reply to ``req`` says: ``output_ids``, ``feature_sum`` (exact),
    ``image_tokens``."""
    per = image_tokens(req.size)
    n_input = len(_text_ids(req.prompt)) + req.images * (per + 2)
    h = _hash(req) if req.images else 0
    pixels = 3 * req.size * req.size
    return {
        "output_ids": _output_ids(n_input, h, req.max_new_tokens),
        "feature_sum": sum(pixel_value(req.seed, k) * pixels for k in range(req.images)),
        "image_tokens": per * req.images,
    }
