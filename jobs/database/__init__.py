"""The database: engine, sessions and migrations, the tables, the replicas' own tables, metric
blocks read back, and bounding what an ended run keeps.
"""
