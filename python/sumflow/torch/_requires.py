"""The torch releases sumflow.torch runs on, checked once, when it is imported.

The core is not built against torch, so one wheel serves every release from the oldest
one tested (``scripts/test.sh`` runs the torch tests with it too) to the newest. What
the plugin needs of torch is checked by feature, not by version number, so that a
release without it fails here, naming it, instead of deep inside a training step.
"""

from __future__ import annotations

import torch

#: The oldest torch release the torch tests run against (requirements-torch-oldest.txt).
OLDEST = "2.1"


def check(tensor_type: type = torch.Tensor) -> None:
    """Raises ImportError unless `tensor_type` (torch's Tensor) has what the plugin calls."""
    # DistributedOptimizer sends a gradient once it is accumulated into .grad (torch 2.1).
    if not hasattr(tensor_type, "register_post_accumulate_grad_hook"):
        raise ImportError(
            f"sumflow.torch needs torch {OLDEST} or later (Tensor."
            f"register_post_accumulate_grad_hook); this is torch {torch.__version__}: "
            f"pip install 'torch>={OLDEST}'"
        )


check()
