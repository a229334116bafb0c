"""The memory store on PostgreSQL with pgvector: connection, schema, migrations, log reading."""
