"""What ships: `import infer` needs only torch + transformers (and what they import, e.g. tqdm), the
presets and the default head are in the package (the import directions: test_layout.py)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_import_infer_pulls_no_heavy_optional_dependency():
    code = (
        "import sys, infer, heads; "
        "print(sorted(m for m in ('accelerate', 'peft', 'datasets', 'matplotlib', 'deepspeed', 'train') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_tree_presets_ship_with_the_package():
    import infer

    presets = pathlib.Path(infer.__file__).parent / "presets" / "trees"
    assert sorted(p.name for p in presets.glob("*.json")) == sorted(p.name for p in (ROOT / "configs" / "trees").glob("*.json"))


def test_default_head_ships_small_and_in_half_precision():
    import json

    from safetensors import safe_open

    import heads.io

    assert "default" in heads.io.pretrained_names()
    d = heads.io.PRETRAINED_DIR / "default"
    weights = d / "model.safetensors"
    assert weights.stat().st_size <= 20 * 10**6
    with safe_open(str(weights), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert "F32" not in dtypes and "BF16" in dtypes
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["verifier"]["name"] == "default" and cfg["training"]["steps"] > 0
    assert "_name_or_path" not in cfg["layer_config"]  # no path of the machine that trained it
    assert "estimated tau" in (d / "README.md").read_text()


def test_children_find_the_packages_and_the_shipped_prompts():
    """``python -m`` children get the directory that holds heads/, infer/ and train/ on their path,
    and the selfcheck's default prompts ship inside ``infer``."""
    from importlib import resources

    from infer.tools.procs import child_env, package_root

    assert all((package_root() / name / "__init__.py").is_file() for name in ("heads", "infer", "train"))
    assert str(package_root()) in child_env({})["PYTHONPATH"].split(":") or "site-packages" in str(package_root())
    assert (resources.files("infer") / "presets" / "prompts" / "unseen.jsonl").is_file()
