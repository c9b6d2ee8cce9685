"""What both modes stand on: the lifecycle (:mod:`.base`), the call discipline (:mod:`.calls`),
the page pool (:mod:`.pages`) and the step plan (:mod:`.step`)."""
