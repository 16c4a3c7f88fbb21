"""Maps the top-level folders into the ``phloem`` namespace (see docs/design.md §1)."""

from pathlib import Path

from setuptools import find_packages, setup

ROOTS = {
    "phloem": "phloem",
    "phloem.lang": "lang",
    "phloem.runtime": "runtime",
    "phloem.grammars": "grammars",
    "phloem.bench": "benchmarks",
    "phloem.training": "training",
}
# Peer launch scripts stay out of the wheel (benchmarks/results holds only JSON).
EXCLUDE = ["peers", "peers.*", "tests", "tests.*"]

packages: list[str] = []
for name, folder in ROOTS.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(folder, exclude=EXCLUDE)]
    # data folders (weights, prompts, grammars) ship as packages of their own: setuptools only
    # takes files that belong to a package
    for path in sorted(Path(folder).rglob("assets")):
        packages.append(".".join([name, *path.relative_to(folder).parts]))

setup(packages=packages, package_dir=dict(ROOTS))
