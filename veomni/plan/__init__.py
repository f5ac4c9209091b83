"""`python -m veomni.plan`: memory, communication and step time of a run on a fake cluster (see __main__.py)."""
