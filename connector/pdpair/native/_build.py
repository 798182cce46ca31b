from cffi import FFI
ffibuilder = FFI()
ffibuilder.cdef("int pdpair_dummy(void);")
ffibuilder.set_source("pdpair.native._pdpair_native", "int pdpair_dummy(void){return 7;}")
