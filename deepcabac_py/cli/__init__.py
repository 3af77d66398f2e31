"""The ``deepcabac`` command line (click).

May import: anything in the package; nothing imports it. ``main`` holds the group and the model
commands, ``update`` the ``update`` group, ``common`` what both share (errors, input, output).
"""
