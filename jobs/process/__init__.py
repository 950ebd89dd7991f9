"""The process itself: settings (and secret files, Google's environment), the dependencies use-
cases take, the one place adapters are built, and log output.
"""
