"""An inference server's shape, end to end, over ringwire.

    HTTP (Starlette on uvicorn) -> tokenizer -> scheduler -> N ranks (broadcast)
                                                             -> replies back up the chain

* :mod:`pipeline.records` -- the records, shaped like SGLang's ``MultimodalDataItem`` /
  ``MultimodalProcessorOutput``;
* :mod:`pipeline.stages` -- what each process computes (the same for every transport);
* :mod:`pipeline.workers` -- the worker processes (``ringwire.runtime`` entries);
* :mod:`pipeline.app` -- the HTTP front end and its ringwire backend.

Run ``python examples/pipeline --port 8000 --ranks 2`` (see ``examples/README.md``).
"""
