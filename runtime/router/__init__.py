"""The data-parallel router: one HTTP front for several ``phloem serve`` workers (docs/scaling.md).

``phloem router --worker-urls ...`` runs it alone; ``phloem serve --dp-size N`` starts N workers and
runs it in front of them (``dp.py``).
"""
