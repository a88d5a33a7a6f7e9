"""The only modules that touch private or undocumented names of Celery, kombu, billiard or py-amqp."""
