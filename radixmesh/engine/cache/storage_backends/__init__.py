"""The L3 storage backends (memory, file, redis, mooncake), one module each, each implementing
`engine.cache.storage.PageStorage`. Nothing is imported here: `engine.cache.storage.open_storage` imports the one
a process asks for, so redis and Mooncake load only where they are used."""
