# Two H100 nodes with local NVMe, one L40S node with a Cinder model-cache volume, three service nodes
# with floating IPs. Credentials come from clouds.yaml: export OS_CLOUD=mycloud before llmctl infra plan.
provider "openstack" {}

module "sarv" {
  source = "../../"

  name_prefix         = "sarv-demo"
  image_id            = var.image_id
  create_keypair      = true
  public_key          = var.public_key
  create_router       = true
  external_network_id = var.external_network_id
  enable_floating_ips = true
  floating_ip_pool    = "public"
  admin_allowed_cidrs = ["192.0.2.0/24"]
  api_allowed_cidrs   = ["10.0.0.0/8"]

  gpu_pools = {
    h100 = {
      flavor_name      = "gpu.h100.8x"
      count            = 2
      gpu_model        = "H100-SXM5-80GB"
      gpu_count        = 8
      gpu_memory_mib   = 81559
      gpu_interconnect = "nvlink"
      numa_nodes       = 2
      labels           = { tier = "prod" }
      model_cache      = { kind = "local", local_devices = ["/dev/nvme0n1", "/dev/nvme1n1"] }
    }
    l40s = {
      flavor_name    = "gpu.l40s.2x"
      count          = 1
      gpu_model      = "L40S"
      gpu_count      = 2
      gpu_memory_mib = 46068
      model_cache    = { kind = "volume", volume_size_gb = 500 }
    }
  }

  service_flavor_name = "m1.xlarge"
  service_count       = 3
  gpu_nodes_vars      = { nvidia_driver_branch = "550", cuda_version = "12.4" }
}
