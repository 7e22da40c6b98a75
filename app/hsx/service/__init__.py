"""What the API's routes do besides HTTP: creating jobs from submitted samples, acting on jobs and
their files under the output root, and answering with stored tensors.

Business errors are `hsx.service.errors.ServiceError`s; each carries the HTTP status and problem
fields the API answers with, so this package raises them without knowing the routes.
"""
