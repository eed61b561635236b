"""The records of the pipeline, shaped like SGLang's.

``MultimodalDataItem`` / ``MultimodalProcessorOutput`` follow SGLang's
``sglang.srt.managers.schedule_batch`` structs: an item carries its modality, a 64-bit
``hash`` of its content, the ``pad_value`` its tokens are replaced with, the
``offsets`` (start, end) of its token spans in ``input_ids``, the ``feature`` (pixel
values: one tensor of every image of the request, ``[n, 3, H, W]``) and, in
``model_specific_data``, what a model adds: ``image_grid_thw`` (a numpy array, one
``(t, h, w)`` row per image, in 14-pixel patches) and a numpy scalar.  They are
``ringwire.SGLangRecord`` classes, so ``Encoder(profile="sglang")`` writes exactly the
bytes SGLang's own msgpack encoder writes for them (the ZeroMQ peers of
``perf/pipeline.py`` use that), while over ringwire channels they travel with the
feature tensor in a shared-memory slot.

The other records are the pipeline's own envelopes: the HTTP request, the tokenized
request (tokenizer -> scheduler), a step (scheduler -> every rank), one rank's output
and the reply that goes back up the chain.
"""

from __future__ import annotations

import enum
from typing import Optional

import ringwire

__all__ = [
    "DTYPES",
    "MAX_IMAGES",
    "MAX_PROMPT",
    "MAX_SIZE",
    "GenerateRequest",
    "Modality",
    "MultimodalDataItem",
    "MultimodalProcessorOutput",
    "RankOutput",
    "Reply",
    "Step",
    "TokenizedRequest",
]

DTYPES = ("float32", "bfloat16")  # the pixel dtypes a request may ask for
MAX_IMAGES = 4
MAX_SIZE = 448  # pixels per side (a multiple of 28)
MAX_PROMPT = 4096  # characters


class Modality(enum.Enum):
    IMAGE = 1
    MULTI_IMAGES = 2
    VIDEO = 3
    AUDIO = 4


class MultimodalDataItem(ringwire.SGLangRecord):
    """One modality's data of one request (SGLang's ``MultimodalDataItem``); undeclared
    attributes (``item.image_grid_thw = ...``) go into ``model_specific_data``."""

    modality: Modality
    hash: Optional[int] = None
    pad_value: Optional[int] = None
    offsets: Optional[list[tuple[int, int]]] = None
    feature: Optional[object] = None  # a torch tensor [n, 3, H, W]: by slot over ringwire


class MultimodalProcessorOutput(ringwire.SGLangRecord, model_specific_data=False):
    """What the multimodal processor makes of one request (SGLang's
    ``MultimodalProcessorOutput``, the fields this pipeline uses)."""

    input_ids: list[int]
    mm_items: list[MultimodalDataItem]
    im_token_id: Optional[int] = None
    im_start_id: Optional[int] = None
    im_end_id: Optional[int] = None


class GenerateRequest(ringwire.Record):
    """The HTTP request, as the front end hands it to the tokenizer: a prompt and
    ``images`` synthetic images of ``size`` x ``size`` pixels (their content follows
    from ``seed``; see :func:`pipeline.stages.pixel_value`)."""

    rid: str
    prompt: str
    images: int = 0
    seed: int = 0
    dtype: str = "float32"
    size: int = MAX_SIZE
    max_new_tokens: int = 4


class TokenizedRequest(ringwire.Record):
    """Tokenizer -> scheduler (SGLang's ``TokenizedGenerateReqInput``, trimmed)."""

    rid: str
    input_text: str
    mm_inputs: MultimodalProcessorOutput
    max_new_tokens: int = 4


class Step(ringwire.Record):
    """Scheduler -> every rank: one batch.  ``trace``: when the scheduler traces, one
    W3C ``[traceparent, tracestate]`` per request (its ``pipeline.step`` span), so each
    rank continues each request's own trace (:mod:`pipeline.observe`); else empty."""

    step: int
    reqs: list[TokenizedRequest]
    trace: list[list[str]] = []


class RankOutput(ringwire.Record):
    """One rank's answer for one step: per request, its share of the feature sum and
    the output tokens (identical on every rank, as tensor-parallel ranks' are)."""

    step: int
    rank: int
    partial_sums: list[float]
    output_ids: list[list[int]]


class Reply(ringwire.Record):
    """Scheduler -> tokenizer -> front end: the answer to one request."""

    rid: str
    output_ids: list[int]
    feature_sum: float
    image_tokens: int
    ranks: int
    step: int
    batch: int
