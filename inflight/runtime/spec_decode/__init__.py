"""Speculative decoding: the config and the n-gram proposer (``speculative``), the draft model
(``draft_proposer``, ``draft_checks``), verification (``verify``) and grammar-constrained drafts
(``grammar``)."""
