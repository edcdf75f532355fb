"""The Ray side of etrain, in rooms by role (each imports only the ones after it):

    cli/         the ``etrain`` command and what it shows
    chaos/       ``etrain chaos``: faults injected into a live run, judged against a reference
    driver/      prepare, launch, follow and resume a run
    controller/  one run's controller: the loop, its states, observers, the run's own policy
    workers/     the worker actors, their group, the memory tier's restore over Ray
    service/     the cluster's allocator and its scheduling policy, the queue, drains, authorization
    plot         ``etrain plot`` (and the chaos plot's drawing)
    store/       the run store, its documents, liveness, this user's runs
    config       ``[elastic]`` and ``[recovery]``, parsed once      phase   every phase name
"""
