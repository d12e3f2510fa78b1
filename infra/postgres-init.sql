-- One Postgres, three databases: Prefect's (created by POSTGRES_DB), MLflow's, and flywheel's event
-- store (store.url = postgresql://flywheel@postgres:5432/flywheel; flywheel creates its tables).
CREATE DATABASE mlflow;
CREATE DATABASE flywheel;
