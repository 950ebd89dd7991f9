"""Use-cases the front ends call: launching and driving runs, channel operations, resubmits, a
run's pinned code and its logs.
"""
