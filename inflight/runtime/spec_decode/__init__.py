"""Speculative decoding: the config and the n-gram proposer (``speculative``), the draft model
(``draft_proposer``, ``draft_checks``), the EAGLE-3 head (``eagle3``, ``eagle3_head``), the served
model's own MTP layer (``mtp``, ``mtp_head``), what a drafter hands the engine (``proposal``),
verification (``verify``) and grammar-constrained drafts (``grammar``). Drafters read the
scheduler's plain chunks and write no request: what the core must learn from them (the draft KV
lag) is a result the engine applies (``core/batch_run.py``)."""
