"""Model families, one module each over the shared layers in runlm.nn; see models.registry."""
