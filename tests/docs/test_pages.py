"""The pages' code runs and says what it gives: each Python block of a page that the
build does not execute is run here on 8 fake CPU devices (with what the page leaves to
the reader, such as a loss function and batches), and each comment that states a
sharding is checked against the value the line gives."""

import pathlib
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxstep

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: a line that shows a sharding: ``expr  # NamedSharding(mesh or Mesh(...), P(...))``
SHOWN = re.compile(
    r"^(?P<expr>\S.*?)\s+# NamedSharding\((mesh|Mesh\((?P<axes>[^)]*)\)), (?P<spec>P\(.*\))\)$"
)


def python_blocks(page: str) -> list[str]:
    """A page's Python blocks, each dedented (a block in a list is indented)."""
    text = (ROOT / "docs" / page).read_text()
    found = re.findall(r"^( *)```python\n(.*?)^\1```$", text, flags=re.MULTILINE | re.DOTALL)
    return [textwrap.dedent(block) for _, block in found]


def reader_context() -> dict:
    """What a sharding.md reader brings: a loss of the page's MLP, and batches."""

    def loss_fn(params, batch):
        h = jax.nn.relu(batch["image"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
        logits = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    rng = np.random.default_rng(0)
    batches = [
        {"image": rng.normal(size=(32, 784)).astype(np.float32), "label": rng.integers(0, 10, 32)}
        for _ in range(2)
    ]
    modules = {"jax": jax, "jnp": jnp, "optax": optax, "jaxstep": jaxstep}
    return modules | {"loss_fn": loss_fn, "batches": batches}


def shown(block: str) -> list[tuple[str, str | None, str]]:
    """Each line of ``block`` that states a sharding: its expression, the mesh's axes
    (None: written ``mesh``) and the spec."""
    found = [SHOWN.match(line) for line in block.splitlines()]
    return [(m["expr"], m["axes"], m["spec"]) for m in found if m]


def test_the_sharding_page_runs_and_its_comments_give_the_shardings_it_gets():
    blocks = [b for b in python_blocks("sharding.md") if "NamedSharding(" in b]
    assert len(blocks) == 2  # the replicated-group snippet and the hybrid one
    context = reader_context()
    stated = []
    for block in blocks:
        exec(block, context)
        for expr, axes, spec in shown(block):
            sharding = eval(expr, context)
            assert sharding.spec == eval(spec, {"P": P}), (expr, spec, sharding.spec)
            if axes is not None:
                written = dict(re.findall(r"'(\w+)': (\d+)", axes))
                assert {k: str(v) for k, v in sharding.mesh.shape.items()} == written
            stated.append((spec, axes))
    assert stated == [("P('devices',)", None), ("P('fsdp',)", "'data': 2, 'fsdp': 4")]


def test_the_testing_pages_fixture_example_runs_as_written(jaxstep_tiny_step):
    (block,) = [b for b in python_blocks("testing.md") if "(jaxstep_tiny_step)" in b]
    module: dict = {}  # a test file of the reader's: only what the block imports
    exec(block, module)
    module["test_the_history_has_a_loss_per_step"](jaxstep_tiny_step)
