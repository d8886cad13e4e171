"""Client-level differential privacy (docs/privacy.md): the clipping every device applies to its
update (``clipping.py``), the Gaussian noise (``noise.py``) and the accountant that turns a run's
rounds into an epsilon (``accountant.py``, over Opacus; imported only where a run adds noise)."""
