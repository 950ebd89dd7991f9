"""The HTTP side: the server and its hardened listeners, the admin port, people's API tokens and
the Prometheus metrics.
"""
