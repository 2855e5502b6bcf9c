"""Weight transfer: the trained weights, published as HF-named buckets.

Where it fits: after every rollout step each training backend's
``weight_buckets(bucket_bytes)`` streams its full weights through
:mod:`vime.weights.buckets` (bounded by ``--update-weight-buffer-size``, one
bucket materialized at a time); the transports deliver those buckets to the
rollout engines' ``update_weights``, and :mod:`vime.weights.hf_export` writes
the same stream as a loadable HF folder for ``--save-hf`` / ``export_hf``.
Nothing here depends on which backend produced the weights.
"""
