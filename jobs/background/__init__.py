"""Work that runs later or on a schedule: the scheduler and its leader lease, the scheduled jobs'
bodies, deferred work rows and the worker pool.
"""
