"""The wheel holds every package: pyproject.toml lists each folder with an __init__.py under
vsa2_rl/, kernels/ and rewards/ (an editable install finds them anyway, so a missing one only
breaks installed copies, such as the GPU machine's)."""

import os

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_pyproject_lists_every_package():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    on_disk = set()
    for package, folder in setuptools["package-dir"].items():
        for root, _, files in os.walk(os.path.join(REPO, folder)):
            if "__init__.py" in files and "__pycache__" not in root:
                relative = os.path.relpath(root, os.path.join(REPO, folder))
                on_disk.add(
                    package if relative == "." else f"{package}.{relative.replace(os.sep, '.')}"
                )
    assert on_disk == set(setuptools["packages"])
