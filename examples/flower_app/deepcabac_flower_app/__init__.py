"""A Flower app whose updates travel as deepcabac update streams (see ``examples/flower_app/README.md``)."""
