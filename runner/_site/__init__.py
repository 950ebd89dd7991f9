"""The directory the supervisor puts first on the command's ``PYTHONPATH``: its
``sitecustomize`` makes every Python process of the command ready to dump its stacks
(:mod:`runner.stacks`). Nothing else lives here, so nothing else shadows the
command's own modules."""
