"""The CPU executor's policy: thread counts and placement (``device_setup``), decode lanes
(``lanes``) and the allocator (``allocator``)."""
