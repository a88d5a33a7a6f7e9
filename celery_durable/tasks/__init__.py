"""``@app.durable_task``: the decorator, its execution, the step context, revocation and operator actions on runs."""
