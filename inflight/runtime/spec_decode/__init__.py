"""Speculative decoding: the config and the n-gram proposer (``speculative``), the draft model
(``draft_proposer``, ``draft_checks``), the EAGLE-3 head (``eagle3``, ``eagle3_head``), what a
drafter hands the engine (``proposal``), verification (``verify``) and grammar-constrained drafts
(``grammar``)."""
