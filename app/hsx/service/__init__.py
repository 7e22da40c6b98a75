"""What the API's routes do besides HTTP: creating jobs from submitted samples, acting on jobs and
their files under the output root, answering with stored tensors, and every read the routes make
(queries.py, status.py), answered as the wire models of hsx.wire (views.py turns rows into them).

Business errors are `hsx.service.errors.ServiceError`s; each carries the HTTP status and problem
fields the API answers with, so this package raises them without knowing the routes.
"""
