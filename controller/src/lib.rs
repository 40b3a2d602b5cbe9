//! ResourceSlice model (inventory + node policy + API capabilities -> slices) and publisher.
