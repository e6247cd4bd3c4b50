"""The intersphinx inventories kept in docs/_inventories/ (the build runs offline) and
scripts/inventories.py, which refreshes them: the names the site refers to land on
their projects' official pages, whatever path an annotation spells them with."""

import importlib.util
import pathlib
import sys

import pytest
from sphinx.util.inventory import InventoryFile

ROOT = pathlib.Path(__file__).resolve().parents[2]
INVENTORIES = ROOT / "docs" / "_inventories"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "inventories", ROOT / "scripts" / "inventories.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def uris(project: str) -> dict[str, str]:
    site = f"https://{project}.example/"
    inventory = InventoryFile.loads((INVENTORIES / f"{project}.inv").read_bytes(), uri=site)
    data = getattr(inventory, "data", inventory)
    return {
        name: item.uri.removeprefix(site) for names in data.values() for name, item in names.items()
    }


def test_the_names_the_reference_links_land_on_their_official_pages():
    jax = uris("jax")
    assert jax["jax.Array"] == "_autosummary/jax.Array.html#jax.Array"
    assert jax["jax.sharding.Mesh"] == "jax.sharding.html#jax.sharding.Mesh"
    assert jax["jaxlib._jax.Device"] == "_autosummary/jax.Device.html#jax.Device"
    optax = uris("optax")
    page = "api/generated/optax.GradientTransformation.html#optax.GradientTransformation"
    assert optax["optax.GradientTransformation"] == page
    assert optax["optax._src.base.GradientTransformation"] == page
    assert uris("numpy")["np.ndarray"] == "reference/generated/numpy.ndarray.html#numpy.ndarray"
    assert uris("flax")["flax.nnx.Module"] == "api_reference/flax.nnx/module.html#flax.nnx.Module"
    python = uris("python")
    assert python["int"] == "library/functions.html#int"
    assert python["collections.abc.Sequence"] == (
        "library/collections.abc.html#collections.abc.Sequence"
    )


def test_a_private_spelling_is_read_as_its_public_name(script):
    def public(target, context=""):
        obj = script.lookup(target, context)
        project = script.project_of(obj)
        return project, script.public_name(target, obj, project)

    assert public("jax.jaxlib._jax.Array") == ("jax", "jax.Array")  # jax.Array's own repr
    assert public("jaxlib._jax.Device") == ("jax", "jax.Device")
    assert public("jax._src.stages.Compiled") == ("jax", "jax.stages.Compiled")
    assert public("jax.sharding.PartitionSpec") == ("jax", "jax.sharding.PartitionSpec")
    assert public("optax._src.base.GradientTransformation") == (
        "optax",
        "optax.GradientTransformation",
    )
    assert public("np.ndarray") == ("numpy", "numpy.ndarray")
    assert public("Mapping") == ("python", "collections.abc.Mapping")
    assert public("None") == ("python", "None")
    assert script.project_of(script.lookup("matplotlib.axes.Axes")) is None  # not linked


def test_an_inventory_is_written_with_sphinxs_writer_and_reads_back(script, tmp_path):
    items = [("jax.Array", "py:class", "_autosummary/jax.Array.html", "jax.Array", "-")]
    items.append(
        ("jaxlib._jax.Array", "py:class", "_autosummary/jax.Array.html", "jax.Array", "jax.Array")
    )
    script.write(tmp_path / "jax.inv", "jax", "0.1", items)
    inventory = InventoryFile.loads((tmp_path / "jax.inv").read_bytes(), uri="https://x/")
    data = getattr(inventory, "data", inventory)["py:class"]
    assert data["jaxlib._jax.Array"].uri == "https://x/_autosummary/jax.Array.html#jax.Array"
    assert data["jaxlib._jax.Array"].display_name == "jax.Array"
    assert data["jax.Array"].project_version == "0.1"
