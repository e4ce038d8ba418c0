"""Horovod's elastic API (``hvd.elastic``): not carried by sumflow yet.

A sumflow job's membership is fixed when it starts; elastic workers and servers are
planned. Each entry point raises ``NotImplementedError`` saying so, so a script written
for Horovod Elastic fails at once instead of training on without recovery.
"""

from __future__ import annotations

from typing import Any, NoReturn

_WHY = (
    "sumflow.torch.elastic is not supported yet: a sumflow job keeps the workers it started "
    "with; run the script without hvd.elastic (it restarts from its checkpoints)"
)


def _refuse() -> NoReturn:
    raise NotImplementedError(_WHY)


def run(func: Any) -> Any:
    """Horovod's ``elastic.run`` decorator: refused (see the module docs)."""
    _refuse()


class TorchState:
    """Horovod's elastic state: refused (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse()


class ElasticSampler:
    """Horovod's elastic sampler: refused (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse()
