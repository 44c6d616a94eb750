//! C controls of the simulated device.
