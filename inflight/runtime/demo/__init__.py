"""The demo model the tests and ``make run-demo`` serve: a random-weight Llama with a byte-level BPE
tokenizer trained on local text (``model``), and its chat templates (``chat_templates``)."""
