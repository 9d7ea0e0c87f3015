"""EPBuffer, the front door: dispatch / combine on both backends against tritonep.reference, errors, protocol."""
