"""Maps the top-level folders into the ``phloem`` namespace (see docs/design.md §1)."""

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

setup(packages=packages, package_dir=dict(ROOTS))
