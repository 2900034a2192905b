"""gangflow's Airflow side: operators, triggers, gang backends, the failure classifier and the
registry logic.

Nothing here imports torch at import time: Airflow imports these modules in the scheduler,
the DAG processor and every worker, where torch would cost seconds and gigabytes.
"""
