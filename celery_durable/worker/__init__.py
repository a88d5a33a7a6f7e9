"""The ``-P durable`` worker: a pool alias, a consumer that claims instead of prefetching."""
